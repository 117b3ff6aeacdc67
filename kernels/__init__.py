"""Hot-path operators for shiftnode: torch references (``kernels.reference``) and Triton kernels.

This package never imports ``node``.
"""
