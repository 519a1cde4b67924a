"""Who failed or parted first, and what followed?

Every rank's ledger of sync points, where the ranks first parted, the causes and their
consequences, and the failure view.
"""
