"""Holds the sitecustomize.py that `ddpdoctor run` puts first on the job's PYTHONPATH."""
