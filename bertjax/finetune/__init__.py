"""Fine-tuning tasks: what each task reads, trains and is scored by."""
