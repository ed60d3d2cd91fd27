"""The user commands that run on the host: calibrate (machine constants), simulate (the
at-scale projection), report (a run's figures), and what they share (run logs,
provenance, figures). The studies' machinery is the workshop's (lrmoe_studies)."""
