"""Publishing a finished cache: to the Hugging Face Hub or S3, resumable, verified against the ledger."""
