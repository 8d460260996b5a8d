from mlx_mtp.cli import main

main()
