"""Without CUDA, the Triton kernels run under the Triton interpreter.

Triton decides at import whether its functions are interpreted, so TRITON_INTERPRET=1 is set
here, for the whole process, when there is no CUDA device (then Triton could run nothing
else) and Triton has not been imported yet. If another test imported Triton first, the
in-process Triton tests skip and `test_triton_kernels_in_a_fresh_interpreter` runs them in a
subprocess instead.
"""

import os
import sys

import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"
