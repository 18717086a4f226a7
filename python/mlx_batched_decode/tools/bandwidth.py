"""The machine's read bandwidth, measured in the run that compares a kernel's speed with it.

``ReadBandwidth`` reads the way the CPU kernel reads (the extension's native ``ReadProbe``);
``GpuReadBandwidth`` times an ``mx.sum`` of a large buffer on the GPU, a reduction that reads
every byte once. Both have ``probe()`` (one read, blocking; time it in turns with the code it is
compared to), ``gbs(seconds)``, ``nbytes``, ``label`` and ``describe``.
"""

from __future__ import annotations

import mlx.core as mx

from .. import _ext


class ReadBandwidth:
    """Machine read bandwidth, read the way the CPU kernel reads: the extension's ReadProbe (the
    kernel's worker pool, vector loads, four streams per thread) over 4x the last-level cache.

    huge_pages picks the page size of its buffer (compare K/V on huge pages with a probe on huge
    pages, 4 KiB with 4 KiB).
    """

    def __init__(self, huge_pages: bool = True, nbytes: int | None = None):
        self.reader = _ext.ReadProbe(nbytes or 4 * _ext.last_level_cache_bytes(), huge_pages)
        self.nbytes = self.reader.nbytes
        self.label = f"native read probe, {self.reader.isa} loads over {self.nbytes / 2**20:.0f} MiB"
        self.describe = {
            "probe_bytes": self.nbytes, "probe_isa": self.reader.isa,
            "probe_on_huge_pages": self.reader.huge_page_bytes / self.nbytes,
        }

    def probe(self) -> None:
        self.reader.read()

    def gbs(self, seconds: float) -> float:
        return self.nbytes / seconds / 1e9


class GpuReadBandwidth:
    """GPU read bandwidth: ``mx.sum`` of a float32 buffer on the GPU, evaluated, per probe.

    The default 512 MiB is larger than the system-level cache of every Apple chip, so each
    probe reads device memory.
    """

    def __init__(self, nbytes: int = 512 << 20):
        self.buffer = mx.ones((nbytes // 4,), dtype=mx.float32, stream=mx.gpu)
        mx.eval(self.buffer)
        self.nbytes = self.buffer.nbytes
        self.label = f"mx.sum over {self.nbytes / 2**20:.0f} MiB on the GPU"
        self.describe = {"probe_bytes": self.nbytes, "probe": "mx.sum on the GPU"}

    def probe(self) -> None:
        mx.eval(mx.sum(self.buffer, stream=mx.gpu))

    def gbs(self, seconds: float) -> float:
        return self.nbytes / seconds / 1e9


def device_read_bandwidth(device: mx.Device) -> ReadBandwidth | GpuReadBandwidth:
    """The read-bandwidth probe of ``device``: the GPU's reduction or the CPU's native probe."""
    return GpuReadBandwidth() if device.type == mx.DeviceType.gpu else ReadBandwidth()
