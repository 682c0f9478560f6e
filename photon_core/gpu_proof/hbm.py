"""The HBM bandwidth a step's floor is computed at, by the device's name: the lent machines are an
H100 (the device tool's default kind) or an H200, and a floor at the wrong one's bandwidth is off by
43%. NVIDIA's nominal figures (TB/s, 1e12 bytes a second):

  H200 (SXM and NVL)             4.8    NVIDIA's H200 page / datasheet
  H100 SXM ("H100 80GB HBM3")    3.35   NVIDIA's H100 datasheet
  H100 PCIe                      2.0    NVIDIA H100 PCIe product brief PB-11133-001 ("greater than 2,000 GB/s")

Any other device (the H100 NVL among them: its figure was not established from NVIDIA's own text
here; a GH200; a name not seen before) keeps the default the scripts always used, the H200's 4.8,
and the results say so (`source`). torch.cuda.get_device_name() names the H100 SXM "NVIDIA H100
80GB HBM3" (seen on the lent machine), the PCIe card "NVIDIA H100 PCIe", the H200 "NVIDIA H200"."""
from __future__ import annotations

DEFAULT_TBPS = 4.8     # the first GPU run's (an H200's), kept for a device not known here

# (what the name must contain, what it must not, TB/s, what the figure is)
KNOWN: tuple[tuple[tuple[str, ...], tuple[str, ...], float, str], ...] = (
    (("H200",), ("GH200",), 4.8, "NVIDIA H200, 4.8 TB/s nominal"),
    (("H100", "PCIE"), ("NVL",), 2.0, "NVIDIA H100 PCIe, 2.0 TB/s nominal"),
    (("H100", "HBM3"), ("NVL", "PCIE", "GH100"), 3.35, "NVIDIA H100 SXM, 3.35 TB/s nominal"),
    (("H100", "SXM"), ("NVL", "PCIE"), 3.35, "NVIDIA H100 SXM, 3.35 TB/s nominal"),
)


def hbm_tbps(device_name: str, given: float | None = None) -> tuple[float, str]:
    """(TB/s, where the figure comes from) for the device named `device_name`: `given` (a command
    line's) if not None, else the device's nominal figure, else DEFAULT_TBPS, saying it is a guess."""
    if given is not None:
        return float(given), f"given on the command line ({given} TB/s)"
    name = device_name.upper()
    for need, avoid, tbps, what in KNOWN:
        if all(n in name for n in need) and not any(a in name for a in avoid):
            return tbps, f"{what} (by the device name {device_name!r})"
    return DEFAULT_TBPS, (f"UNKNOWN device {device_name!r}: the default {DEFAULT_TBPS} TB/s (an H200's) "
                          "assumed; floors and x floor are against that")
