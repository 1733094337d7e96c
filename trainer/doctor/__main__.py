from trainer.core.errors import exit_now
from trainer.doctor.run import main

exit_now(main())
