// kubelet-streaming: the exec and port-forward half of localcluster's process kubelet.
//
// kube-apiserver reaches the kubelet's HTTPS API for `kubectl exec` and `kubectl port-forward`
// with SPDY/3.1 (or WebSocket) upgrades. The Rust kubelet authenticates the request, finds the
// container, and proxies the upgrade to this server on a unix socket, where the kubelet's own
// streaming library (k8s.io/cri-streaming, what the CRI runtimes' streaming servers use) speaks
// the protocols. What the Rust side found travels in headers:
//
//	X-Localcluster-Nsexec    the localcluster binary, whose `nsexec` subcommand runs a command
//	                         in a container (its namespaces and cgroup)
//	X-Localcluster-Pid       the container's main process
//	X-Localcluster-Cgroup    the container's cgroup, relative to each hierarchy's root
//	X-Localcluster-Netns     (port-forward) the pod's network namespace file
//	X-Localcluster-Pod, -Uid, -Container   for messages
//
// Paths: /exec?<the kubelet's exec query> and /portForward.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"syscall"
	"time"

	"github.com/creack/pty"
	"github.com/vishvananda/netns"
	"k8s.io/cri-streaming/pkg/streaming/portforward"
	"k8s.io/cri-streaming/pkg/streaming/remotecommand"
	utilexec "k8s.io/utils/exec"
)

// The kubelet's defaults (streamingConnectionIdleTimeout, and the CRI streaming server's
// creation timeout).
const (
	streamIdleTimeout     = 4 * time.Hour
	streamCreationTimeout = remotecommand.DefaultStreamCreationTimeout
	// How long output is still read after the command ended (something it started in the
	// background may keep the pipes or the terminal open).
	outputDrain = 2 * time.Second
)

func runStreaming(args []string) int {
	fs := flag.NewFlagSet("kubelet-streaming", flag.ContinueOnError)
	socket := fs.String("socket", "", "the unix socket to serve on (replaced if it exists)")
	exitWithStdin := fs.Bool("exit-with-stdin", false, "exit when standard input reaches its end (the parent kubelet went away)")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if *socket == "" {
		fmt.Fprintln(os.Stderr, "kubelet-streaming: --socket is required")
		return 2
	}
	if *exitWithStdin {
		go func() {
			_, _ = io.Copy(io.Discard, os.Stdin)
			os.Exit(0)
		}()
	}
	_ = os.Remove(*socket)
	listener, err := net.Listen("unix", *socket)
	if err != nil {
		fmt.Fprintf(os.Stderr, "kubelet-streaming: %v\n", err)
		return 1
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		_, _ = io.WriteString(w, "ok")
	})
	mux.HandleFunc("/exec", serveExec)
	mux.HandleFunc("/portForward", servePortForward)
	server := &http.Server{Handler: mux, ReadHeaderTimeout: 30 * time.Second}
	if err := server.Serve(listener); err != nil {
		fmt.Fprintf(os.Stderr, "kubelet-streaming: %v\n", err)
		return 1
	}
	return 0
}

func serveExec(w http.ResponseWriter, req *http.Request) {
	opts, err := remotecommand.NewOptions(req)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	cmd := req.URL.Query()["command"]
	if len(cmd) == 0 {
		http.Error(w, "you must specify at least 1 command", http.StatusBadRequest)
		return
	}
	executor := &nsExecutor{
		nsexec: req.Header.Get("X-Localcluster-Nsexec"),
		pid:    req.Header.Get("X-Localcluster-Pid"),
		cgroup: req.Header.Get("X-Localcluster-Cgroup"),
	}
	if executor.nsexec == "" || executor.pid == "" || executor.cgroup == "" {
		http.Error(w, "X-Localcluster-Nsexec, X-Localcluster-Pid and X-Localcluster-Cgroup are required", http.StatusBadRequest)
		return
	}
	remotecommand.ServeExec(w, req, executor, req.Header.Get("X-Localcluster-Pod"),
		req.Header.Get("X-Localcluster-Uid"), req.Header.Get("X-Localcluster-Container"), cmd,
		opts, streamIdleTimeout, streamCreationTimeout, remotecommand.SupportedStreamingProtocols)
}

// nsExecutor runs commands in a container through `localcluster nsexec`.
type nsExecutor struct {
	nsexec, pid, cgroup string
}

func (e *nsExecutor) ExecInContainer(_ context.Context, _, _, _ string, cmd []string, in io.Reader, out, errOut io.WriteCloser, tty bool, resize <-chan remotecommand.TerminalSize, _ time.Duration) error {
	args := []string{"nsexec", "--pid", e.pid, "--cgroup", e.cgroup}
	if tty {
		args = append(args, "--tty")
	}
	args = append(args, "--")
	c := exec.Command(e.nsexec, append(args, cmd...)...)
	var err error
	if tty {
		err = runTerminal(c, in, out, resize)
	} else {
		err = runPipes(c, in, out, errOut)
	}
	return exitError(cmd, err)
}

// runPipes runs c with the streams as its standard input, output and error.
func runPipes(c *exec.Cmd, in io.Reader, out, errOut io.Writer) error {
	if out != nil {
		c.Stdout = out
	}
	if errOut != nil {
		c.Stderr = errOut
	}
	// Not c.Stdin = in: Wait would wait for the copy, that is for the client to close stdin.
	var stdin io.WriteCloser
	if in != nil {
		pipe, err := c.StdinPipe()
		if err != nil {
			return err
		}
		stdin = pipe
	}
	c.WaitDelay = outputDrain
	if err := c.Start(); err != nil {
		return err
	}
	if stdin != nil {
		go func() {
			_, _ = io.Copy(stdin, in)
			_ = stdin.Close()
		}()
	}
	return c.Wait()
}

// runTerminal runs c on a new pseudo-terminal (its session leader; `nsexec --tty` makes it the
// command's controlling terminal) and applies the client's resize events.
func runTerminal(c *exec.Cmd, in io.Reader, out io.Writer, resize <-chan remotecommand.TerminalSize) error {
	ptmx, tty, err := pty.Open()
	if err != nil {
		return err
	}
	defer func() { _ = ptmx.Close() }()
	c.Stdin, c.Stdout, c.Stderr = tty, tty, tty
	c.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	err = c.Start()
	_ = tty.Close()
	if err != nil {
		return err
	}
	if resize != nil {
		go func() {
			for size := range resize {
				_ = pty.Setsize(ptmx, &pty.Winsize{Rows: size.Height, Cols: size.Width})
			}
		}()
	}
	if in != nil {
		go func() { _, _ = io.Copy(ptmx, in) }()
	}
	if out == nil {
		out = io.Discard
	}
	drained := make(chan struct{})
	go func() {
		// Ends with EIO once nothing holds the terminal any more.
		_, _ = io.Copy(out, ptmx)
		close(drained)
	}()
	err = c.Wait()
	select {
	case <-drained:
	case <-time.After(outputDrain):
	}
	return err
}

// exitError turns a non-zero exit into the error the streaming library reports as the exit
// code (a k8s.io/utils/exec.ExitError), as the CRI runtimes do.
func exitError(cmd []string, err error) error {
	var exitErr *exec.ExitError
	if !errors.As(err, &exitErr) {
		return err
	}
	code := exitErr.ExitCode()
	if status, ok := exitErr.Sys().(syscall.WaitStatus); ok && status.Signaled() {
		code = 128 + int(status.Signal())
	}
	return utilexec.CodeExitError{
		Err:  fmt.Errorf("error executing command %v, exit code %d", cmd, code),
		Code: code,
	}
}

func servePortForward(w http.ResponseWriter, req *http.Request) {
	path := req.Header.Get("X-Localcluster-Netns")
	if path == "" {
		http.Error(w, "X-Localcluster-Netns is required", http.StatusBadRequest)
		return
	}
	opts, err := portforward.NewV4Options(req)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	portforward.ServePortForward(w, req, &netnsForwarder{netns: path},
		req.Header.Get("X-Localcluster-Pod"), req.Header.Get("X-Localcluster-Uid"), opts,
		streamIdleTimeout, streamCreationTimeout, portforward.SupportedProtocols)
}

// netnsForwarder connects to a port on the pod's loopback, in its network namespace.
type netnsForwarder struct {
	netns string
}

func (f *netnsForwarder) PortForward(_ context.Context, _, _ string, port int32, stream io.ReadWriteCloser) error {
	conn, err := dialInNetns(f.netns, port)
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close() }()
	go func() {
		_, _ = io.Copy(conn, stream)
		if tcp, ok := conn.(*net.TCPConn); ok {
			_ = tcp.CloseWrite()
		}
	}()
	_, err = io.Copy(stream, conn)
	return err
}

// dialInNetns connects to localhost:port inside the network namespace at path, from a thread
// of its own that enters the namespace and is never handed back to the Go scheduler (it ends
// with its goroutine), as CNI plugins do.
func dialInNetns(path string, port int32) (net.Conn, error) {
	type result struct {
		conn net.Conn
		err  error
	}
	done := make(chan result, 1)
	go func() {
		runtime.LockOSThread()
		ns, err := netns.GetFromPath(path)
		if err != nil {
			done <- result{err: fmt.Errorf("opening the pod's network namespace %s: %w", path, err)}
			return
		}
		defer func() { _ = ns.Close() }()
		if err := netns.Set(ns); err != nil {
			done <- result{err: fmt.Errorf("entering the pod's network namespace %s: %w", path, err)}
			return
		}
		addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(int(port)))
		conn, err := net.DialTimeout("tcp4", addr, 10*time.Second)
		if err != nil {
			addr6 := net.JoinHostPort("::1", strconv.Itoa(int(port)))
			if conn6, err6 := net.DialTimeout("tcp6", addr6, 10*time.Second); err6 == nil {
				conn, err = conn6, nil
			}
		}
		if err != nil {
			err = fmt.Errorf("failed to connect to localhost:%d inside the pod's network namespace: %w", port, err)
		}
		done <- result{conn: conn, err: err}
	}()
	r := <-done
	return r.conn, r.err
}
