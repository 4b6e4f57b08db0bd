"""trainer_logs."""
