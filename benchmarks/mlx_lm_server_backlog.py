"""mlx-lm's server, without the plug-in, listening with the backlog ``serve`` gives it: the peer of
``bench_server.py --burst``, whose burst mlx-lm's stock backlog of 5 would mostly reset.

    python benchmarks/mlx_lm_server_backlog.py [any mlx_lm.server argument]
"""

import sys

from mlx_lm import server

from mlx_batched_decode.integrations.mlx_lm.listen_backlog import wide_listen_backlog

if __name__ == "__main__":
    sys.argv[0] = "mlx_lm.server"
    with wide_listen_backlog():
        server.main()
