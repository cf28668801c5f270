"""pallas_hub: build, verify, publish and load Pallas TPU kernels as Hugging Face Hub kernels."""

__version__ = "0.1.0"
