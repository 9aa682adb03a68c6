"""The FlashInfer backend (`backend.FlashInferBackend`), the arguments of every call it
makes into flashinfer (`calls`), what a plan bakes into a captured CUDA graph
(`plan_layout`) and the pinned buffer its plan inputs travel through (`staging`).

Nothing here imports the flashinfer package at module import: the backend imports it
when it is constructed, so CPU-only machines import (and test) all of this.
"""
