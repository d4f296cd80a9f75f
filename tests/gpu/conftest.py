"""The GPU tests compare against eager float32 at tight tolerances: TF32 matmuls (10-bit mantissa) are off."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _exact_matmuls():
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = tf32
