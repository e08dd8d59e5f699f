// Command kube is the upstream Kubernetes control plane, kubectl and etcd in one binary, as k3s
// and rancher/support-bundle-kit build them: the packages are compiled and linked once instead of
// six times. The component is the name the binary is called by (a symlink named kubectl,
// kube-apiserver, ...) or else the first argument; the rest are its own flags, unchanged.
package main

import (
	"fmt"
	"os"
	"path/filepath"

	"github.com/spf13/cobra"
	"go.etcd.io/etcd/server/v3/etcdmain"
	_ "k8s.io/client-go/plugin/pkg/client/auth"
	"k8s.io/component-base/cli"
	"k8s.io/component-base/logs"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	kubectl "k8s.io/kubectl/pkg/cmd"
	kubectlutil "k8s.io/kubectl/pkg/cmd/util"
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	controllermanager "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	proxy "k8s.io/kubernetes/cmd/kube-proxy/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
)

var components = map[string]func() *cobra.Command{
	"kube-apiserver":          apiserver.NewAPIServerCommand,
	"kube-controller-manager": controllermanager.NewControllerManagerCommand,
	"kube-scheduler":          func() *cobra.Command { return scheduler.NewSchedulerCommand() },
	"kube-proxy":              proxy.NewProxyCommand,
}

const usage = "usage: kube etcd|kube-apiserver|kube-controller-manager|kube-scheduler|kube-proxy|kubectl|kubelet-streaming [flags]"

func main() {
	name := filepath.Base(os.Args[0])
	if name == "kube" {
		if len(os.Args) < 2 {
			fmt.Fprintln(os.Stderr, usage)
			os.Exit(2)
		}
		// kubectl reads os.Args itself (plugins, verbosity): it must see its own name first.
		os.Args = os.Args[1:]
		name = os.Args[0]
	}
	args := os.Args[1:]
	if name == "kubectl" {
		runKubectl()
		return
	}
	if name == "etcd" {
		etcdmain.Main(append([]string{"etcd"}, args...))
		return
	}
	if name == "kubelet-streaming" {
		os.Exit(runStreaming(args))
	}
	newCommand, ok := components[name]
	if !ok {
		fmt.Fprintf(os.Stderr, "kube: unknown component %q\n%s\n", name, usage)
		os.Exit(2)
	}
	command := newCommand()
	command.SetArgs(args)
	os.Exit(cli.Run(command))
}

// runKubectl is cmd/kubectl's main.
func runKubectl() {
	// Verbosity is parsed before the command is built, so that building it logs at that level.
	logs.GlogSetter(kubectl.GetLogVerbosity(os.Args)) // nolint:errcheck
	command := kubectl.NewDefaultKubectlCommand()
	if err := cli.RunNoErrOutput(command); err != nil {
		kubectlutil.CheckErr(err)
	}
}
