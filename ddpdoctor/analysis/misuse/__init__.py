"""Is DDP used as meant?

Unused parameters, samplers and set_epoch judged by what each rank read, the framework that
drove DDP, its models, and replicas that disagree.
"""
