from gpu_busy.cli.run import main
from gpu_busy.process_exit import end_process

end_process(main)
