"""``python -m dofla``: the same as the ``dofla`` command."""
from dofla.cli import main

if __name__ == "__main__":
    main()
