"""Session-wide test settings.

Triton decides between compiling and interpreting when its functions are decorated, including inside its own
package at import time, so ``TRITON_INTERPRET=1`` must be set before anything imports triton: the shared
Triton kernels are then checked on the CPU in this process (tests/test_triton_kernels.py).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
