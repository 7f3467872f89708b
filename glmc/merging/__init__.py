"""Merging many models into one: universe matching, embedding across widths, the N-model merge and the corrections
applied after it (restore norms, refit, REPAIR), and robust averaging."""
