"""Hot-path operators for shiftnode: torch references (``shiftnode_kernels.reference``) and Triton kernels.

This package never imports ``node``.
"""
