from otel_forge.cli import console_main

console_main()
