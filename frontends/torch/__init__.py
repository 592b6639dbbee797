"""smdistributed.dataparallel.torch: the PyTorch frontend.

    import smdistributed.dataparallel.torch.torch_smddp   # registers the "smddp" backend
    torch.distributed.init_process_group(backend="smddp")

The older API lives in `.distributed` and `.parallel` (deprecated, still working).
"""
