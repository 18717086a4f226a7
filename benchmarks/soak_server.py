"""Soak run of the native server: clients sending requests without pause for ``--minutes``.

``--clients`` threads (8 by default) each send one request after another to ``python -m
mlx_batched_decode.serve`` on 127.0.0.1 (the server benchmark's model): text or chat, streamed
or whole, prompts of 5-400 words, 8-64 new tokens, greedy or sampled, and every 10th client
hangs up after its first chunk. The server's resident memory (``VmRSS``) is read every 5 s.

Checks, each a non-zero exit status when it fails: every request that did not hang up was
answered in full (HTTP 200, a ``finish_reason``); the resident memory at the end is within 10%
of its value after the first minute (the warm-up: caches and pools grown to their working
size); and ``/metrics`` shows no request running and no cache held once the clients stop.
Results: ``results/soak_server.json``.

    python benchmarks/soak_server.py                  # 10 minutes, 8 clients
    python benchmarks/soak_server.py --minutes 1
"""

import argparse
import http.client
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench_server import CONFIG, NATIVE, STARTUP_TIMEOUT_S, STOP_TIMEOUT_S, metric_value
from common import machine, save
from mlx_batched_decode.tools.local_server import running_server
from mlx_batched_decode.tools.model_folder import SPECIAL_TOKENS, save_model_folder, word

REQUEST_TIMEOUT_S = 300
WARM_UP_S = 60
TOLERANCE = 0.10


def rss_bytes(pid):
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def one_request(port, rng):
    """One random request; returns "answered", "hung up" or the reason it failed."""
    n = rng.randint(5, 400)
    text = " ".join(word(rng.randrange(len(SPECIAL_TOKENS), CONFIG["vocab_size"])) for _ in range(n))
    chat, stream, hang_up = rng.random() < 0.5, rng.random() < 0.5, rng.random() < 0.1
    body = {"max_tokens": rng.randint(8, 64), "temperature": rng.choice([0, 0.7]), "stream": stream or hang_up}
    if chat:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": text}]
    else:
        path, body["prompt"] = "/v1/completions", text
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
    try:
        connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            return f"HTTP {response.status}: {response.read()[:200]!r}"
        if hang_up:
            response.fp.readline()
            return "hung up"
        raw = response.read()
        if body["stream"]:
            events = [e[len("data: "):] for e in raw.decode().split("\n\n") if e.startswith("data: ")]
            finish = json.loads(events[-2])["choices"][0]["finish_reason"] if len(events) >= 2 else None
        else:
            finish = json.loads(raw)["choices"][0]["finish_reason"]
        return "answered" if finish in ("stop", "length") else f"no finish_reason: {raw[-200:]!r}"
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    finally:
        connection.close()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    outcomes, samples = [], []
    lock = threading.Lock()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_model_folder(CONFIG, Path(tmp, "model"), seed=args.seed)
        command = [*NATIVE, "--model", str(model_dir), "--log-level", "WARNING",
                   "--max-batch-size", str(args.clients)]
        with running_server(command, Path(tmp, "server.log"), STARTUP_TIMEOUT_S, STOP_TIMEOUT_S) as (port, process):
            start = time.monotonic()
            end = start + 60 * args.minutes

            def client(i):
                rng = random.Random(args.seed * 1000 + i)
                while time.monotonic() < end:
                    outcome = one_request(port, rng)
                    with lock:
                        outcomes.append(outcome)

            threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
            for t in threads:
                t.start()
            while any(t.is_alive() for t in threads):
                samples.append((time.monotonic() - start, rss_bytes(process.pid)))
                print(f"\r{samples[-1][0]:6.0f} s  {len(outcomes)} requests  RSS {samples[-1][1] / 2**20:.0f} MiB",
                      end="", file=sys.stderr, flush=True)
                time.sleep(5)
            for t in threads:
                t.join(REQUEST_TIMEOUT_S)
            time.sleep(1)
            held = metric_value(port, "mbd_num_requests_running"), metric_value(port, "mbd_kv_cache_usage")
            samples.append((time.monotonic() - start, rss_bytes(process.pid)))
    print(file=sys.stderr)
    lost = [o for o in outcomes if o not in ("answered", "hung up")]
    warm = next((rss for t, rss in samples if t >= WARM_UP_S), samples[0][1])
    final = samples[-1][1]
    growth = final / warm - 1
    report = {
        "minutes": args.minutes, "clients": args.clients, "requests": len(outcomes),
        "answered": outcomes.count("answered"), "hung_up": outcomes.count("hung up"), "lost": lost[:20],
        "rss_after_warm_up_mib": warm / 2**20, "rss_final_mib": final / 2**20, "rss_growth": growth,
        "held_after": held, "rss_samples": samples,
    }
    for key in ("requests", "answered", "hung_up", "rss_after_warm_up_mib", "rss_final_mib", "rss_growth", "held_after"):
        print(f"{key:22s} {report[key]}")
    print(f"lost: {len(lost)}" + (f", first: {lost[0]}" if lost else ""))
    path = save("soak_server", {"machine": machine(), "config": CONFIG, "report": report})
    print(f"saved {path}")
    failed = bool(lost) or abs(growth) > TOLERANCE or any(held)
    print("FAILED" if failed else f"OK: no request lost, resident memory within {TOLERANCE:.0%}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
