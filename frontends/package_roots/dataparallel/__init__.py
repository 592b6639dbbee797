"""smdistributed.dataparallel: data-parallel training over the native collective engine."""
