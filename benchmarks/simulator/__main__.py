from benchmarks.simulator.cli import main

main()
