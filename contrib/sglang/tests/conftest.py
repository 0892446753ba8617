"""SGLang imports on this CPU machine only with the torchvision stub."""

from kvconn.testing.torchvision_stub import install_torchvision_stub

install_torchvision_stub()
