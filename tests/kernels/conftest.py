"""Kernel tests run the Triton kernels under Triton's CPU interpreter when there is no GPU.

``TRITON_INTERPRET=1`` must be set before ``kvplan.kernels.triton_kernels`` (and Triton's
``@jit``) is imported, so it is set here, at conftest import time. On a machine with a CUDA
GPU it is left alone (unset means compiled kernels on CUDA tensors); set it to ``1``
explicitly there to exercise the interpreter path instead.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
