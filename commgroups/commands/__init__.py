"""Sub-commands of the ``commgroups`` command line, one module each."""
