"""smdistributed: open implementation of SageMaker's distributed training libraries."""
