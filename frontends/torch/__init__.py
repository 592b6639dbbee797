"""smdistributed.dataparallel.torch: the PyTorch frontend (the smddp backend and the older API)."""
