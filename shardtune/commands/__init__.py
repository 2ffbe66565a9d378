"""One verb of the ``shardtune`` command per module, each ``main(argv) -> exit status``: parse, call the library,
print. No command imports another, and nothing below imports a command."""
