"""scheduler_hold."""
