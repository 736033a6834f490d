"""Top-level pytest setup: Triton kernels run in the interpreter when no GPU is present.

This must happen before any kernel module is imported, hence here and not in a test module.
"""
import os
import shutil

if os.environ.get("TRITON_INTERPRET") is None and shutil.which("nvidia-smi") is None:
    os.environ["TRITON_INTERPRET"] = "1"
# Deterministic cuBLAS (must be set before CUDA starts): the GPU tests compare engines token for token.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
