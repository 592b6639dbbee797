"""smdistributed.modelparallel: pipeline-parallel training (smp.step, DistributedModel) on smddp groups."""
