"""smdistributed.dataparallel.tensorflow: the TensorFlow frontend."""
