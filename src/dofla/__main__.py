from dofla.cli import main

main()
