"""What a user declares and its validation: dims, roles, options, elastic rules, layout files
and the input bounds. Pure: nothing here imports torch.distributed.
"""
