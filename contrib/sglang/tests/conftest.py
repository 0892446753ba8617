"""SGLang imports on this CPU machine only with the torchvision stub (cpu_env.py)."""

from cpu_env import install_torchvision_stub

install_torchvision_stub()
