"""`ddpdoctor bench`: the same model and global batch as one process, DataParallel and DDP."""
