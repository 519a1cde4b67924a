"""Where does the time go?

Stragglers, periodic rank-only work, gradient sync, phases, the device's clock and the GPUs, and
two runs compared.
"""
