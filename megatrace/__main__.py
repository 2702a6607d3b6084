from megatrace.cli import main

main()
