"""The one unit convention for memory the project prints, logs or compares: decimal units, GB = 1e9 bytes and
MB = 1e6 bytes (as vendors' datasheets and the ZeRO paper count; a "64 GB" card's 64 GiB is 68.7 GB). Figures read
from a tool in its own binary units (npu-smi's MB = MiB) are converted to bytes first."""

GB = 1e9
MB = 1e6
MIB = 2**20  # only to read binary-unit tool output (npu-smi, msprof KB/MB columns stay as the tool wrote them)
