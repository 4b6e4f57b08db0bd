"""fp32_islands."""
