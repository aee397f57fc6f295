"""Training and measuring EAGLE drafts on CPU: the draft model, its corpus and the resumable run."""
