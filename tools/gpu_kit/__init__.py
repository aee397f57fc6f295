"""The GPU server kit: what the device needs to serve this repository (``python -m tools.gpu_kit.build``)."""
