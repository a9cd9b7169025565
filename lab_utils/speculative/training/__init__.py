"""Training and data for lab 07's proposers: the corpus, the datasets, the training loops of the draft model and the
heads, their warm starts, and the assistant prompts and workloads the lab measures on."""
