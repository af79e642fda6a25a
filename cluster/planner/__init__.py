"""Sizing the pools from SLOs: profiles of a worker's costs (profile.py, costs.py), a
discrete-event simulator of the cluster, and the planner that searches configurations."""
