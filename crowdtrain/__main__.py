from crowdtrain.cli import main

main()
