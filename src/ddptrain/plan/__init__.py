"""``ddptrain plan``: the real job, as a few chosen ranks of the world it will run on, before it runs.

job.py makes the plan (each chosen rank in a process of its own: rank.py, through the fake
process group of fake_group.py), estimate.py turns its measurements into time at the target
scale, report.py prints it. hardware.py holds the machine's figures, imported by the command
line's parser without torch.
"""
