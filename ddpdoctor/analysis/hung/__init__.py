"""Is the job hung, and on what?

The live proof, the hang verdict with its stacks, the Flight Recorder's witness, and what
waiting on a busy rank cost.
"""
