"""Each op class against this device's roofs: ``ProfilerWindows(roofline=True)``.

- :mod:`.peaks`: this device's peaks, measured once per process (dense GEMM per dtype, copy bandwidth, a collective).
- :mod:`.work`: FLOPs and bytes per op class from a window's recorded shapes; achieved rates and the bound.
- :mod:`.view`: the report a reader sees: MFU, the table, the lever (backed by a measurement), the summary lines.
- :mod:`.plot`: the roofline picture (matplotlib).
"""
