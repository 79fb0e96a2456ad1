// Command pause is the sandbox ("pause") container of the test node's pods: it holds
// the pod's namespaces, reaps the zombies re-parented to it (it is PID 1 of the pod
// when the pod shares its PID namespace) and exits 0 on SIGTERM or SIGINT.
//
// Standard library only; built with CGO_ENABLED=0 into a static binary by
// tools/image/build.sh --helpers (image localhost/pause:3.10).
package main

import (
	"fmt"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	if len(os.Args) > 1 && (os.Args[1] == "-v" || os.Args[1] == "--version") {
		fmt.Println("pause (workload-manager test node) 3.10")
		return
	}
	signals := make(chan os.Signal, 8)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT, syscall.SIGCHLD)
	for sig := range signals {
		switch sig {
		case syscall.SIGCHLD:
			reap()
		default:
			fmt.Fprintf(os.Stderr, "pause: %v: exiting\n", sig)
			os.Exit(0)
		}
	}
}

// reap collects every child that has exited; signals coalesce, so one SIGCHLD may
// stand for several of them.
func reap() {
	for {
		var status syscall.WaitStatus
		pid, err := syscall.Wait4(-1, &status, syscall.WNOHANG, nil)
		if err == syscall.EINTR {
			continue
		}
		if pid <= 0 || err != nil {
			return
		}
	}
}
