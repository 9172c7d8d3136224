// Command flyte-pods prints, as YAML, the pods Flyte 1.14's own code creates for the tasks of a matrix
// (copilot raw-container tasks in their shapes, and a plain Python task): flyteplugins' pod plugin at
// v1.14.1 (pod.DefaultPodPlugin.BuildResource) runs against Flyte's own mocks of the task execution context,
// and the pod it builds gets the object metadata flytepropeller's k8s plugin manager gives it before it
// sends it to the API server (addObjectMetadata, ported below). flytepropeller's plugin manager itself is
// not run: v1.14.1 is not served by the Go module proxy, and v1.16.8's does not compile against
// flyteplugins v1.14.1. Its mocks are mockery v1's (OnX().Return). Nothing here builds a container or a volume.
package main

import (
	"context"
	"fmt"
	"os"
	"runtime/debug"
	"strings"

	"github.com/stretchr/testify/mock"
	"google.golang.org/protobuf/types/known/structpb"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/kubernetes/scheme"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/yaml"

	"github.com/flyteorg/flyte/flyteidl/gen/pb-go/flyteidl/core"
	pluginsCore "github.com/flyteorg/flyte/flyteplugins/go/tasks/pluginmachinery/core"
	coreMocks "github.com/flyteorg/flyte/flyteplugins/go/tasks/pluginmachinery/core/mocks"
	"github.com/flyteorg/flyte/flyteplugins/go/tasks/pluginmachinery/flytek8s"
	"github.com/flyteorg/flyte/flyteplugins/go/tasks/pluginmachinery/flytek8s/config"
	ioMocks "github.com/flyteorg/flyte/flyteplugins/go/tasks/pluginmachinery/io/mocks"
	"github.com/flyteorg/flyte/flyteplugins/go/tasks/pluginmachinery/utils"
	"github.com/flyteorg/flyte/flyteplugins/go/tasks/plugins/k8s/pod"
	"github.com/flyteorg/flyte/flytepropeller/pkg/apis/flyteworkflow/v1alpha1"
	k8sTransformer "github.com/flyteorg/flyte/flytepropeller/pkg/compiler/transformers/k8s"
	"github.com/flyteorg/flyte/flytestdlib/storage"
)

const (
	namespace = "flytesnacks-development"
	project   = "flytesnacks"
	domain    = "development"
	bucket    = "my-s3-bucket"
	taskName  = "circle-area"
)

// The labels flytepropeller's node executor puts on a task's metadata
// (flytepropeller/pkg/controller/nodes/node_exec_context.go@v1.14.1 L27-L29). Its package is not imported:
// it imports the plugin manager, which does not compile against flyteplugins v1.14.1.
const (
	nodeIDLabel            = "node-id"
	taskNameLabel          = "task-name"
	nodeInterruptibleLabel = "interruptible"
)

// cell is one task of the matrix. Everything that is not Flyte's default says so here.
type cell struct {
	name, about     string
	inputs, outputs bool
	podTemplate     bool                             // a ContainerTask whose pod template names its primary container
	python          bool                             // a plain Python task: Flyte-owned, no copilot
	taskPaths       bool                             // the task's DataLoadingConfig names its data directories (flytekit always does)
	interruptible   bool                             // and the deployment configures interruptible tolerations and affinity
	resources       *core.Resources                  // the execution's resource overrides (the node's)
	copilot         func(*config.FlyteCoPilotConfig) // the deployment's co-pilot configuration
}

func matrix() []cell {
	overrides := &core.Resources{
		Requests: []*core.Resources_ResourceEntry{{Name: core.Resources_CPU, Value: "2"},
			{Name: core.Resources_MEMORY, Value: "4Gi"}, {Name: core.Resources_EPHEMERAL_STORAGE, Value: "10Gi"}},
		Limits: []*core.Resources_ResourceEntry{{Name: core.Resources_CPU, Value: "2"},
			{Name: core.Resources_MEMORY, Value: "4Gi"}, {Name: core.Resources_EPHEMERAL_STORAGE, Value: "10Gi"}},
	}
	return []cell{
		{name: "io", about: "a raw-container task with inputs and outputs", inputs: true, outputs: true, taskPaths: true},
		{name: "in", about: "a raw-container task with inputs only", inputs: true, taskPaths: true},
		{name: "out", about: "a raw-container task with outputs only", outputs: true, taskPaths: true},
		{name: "none", about: "a raw-container task with neither inputs nor outputs", taskPaths: true},
		{name: "pod-template", about: "a ContainerTask whose pod template names its primary container and adds a " +
			"log forwarder and an init container", inputs: true, outputs: true, taskPaths: true, podTemplate: true},
		{name: "mirror", about: "co-pilot configured with an image from a private registry mirror, its own name " +
			"prefix and data directories (the task names none)", inputs: true, outputs: true,
			copilot: func(c *config.FlyteCoPilotConfig) {
				c.Image = "registry.corp.example:5000/flyteorg/flytecopilot:v1.14.1"
				c.NamePrefix = "copilot-"
				c.DefaultInputDataPath = "/data/in"
				c.DefaultOutputPath = "/data/out"
			}},
		{name: "digest", about: "co-pilot configured with an image pinned by digest", inputs: true, outputs: true,
			taskPaths: true, copilot: func(c *config.FlyteCoPilotConfig) {
				c.Image = "cr.flyte.org/flyteorg/flytecopilot@sha256:" + strings.Repeat("ab", 32)
			}},
		{name: "interruptible", about: "an interruptible raw-container task, the deployment's interruptible " +
			"toleration and node selector requirement configured", inputs: true, outputs: true, taskPaths: true,
			interruptible: true},
		{name: "resources", about: "a raw-container task whose execution overrides its resources (ephemeral " +
			"storage sizes the data volumes)", inputs: true, outputs: true, taskPaths: true, resources: overrides},
		{name: "python", about: "a plain Python task (Flyte-owned, no co-pilot)", python: true},
	}
}

func variables(names ...string) *core.VariableMap {
	vars := map[string]*core.Variable{}
	// One variable per map: proto.Marshal writes maps in random order and the interface is base64 in the args.
	for _, n := range names {
		vars[n] = &core.Variable{Type: &core.LiteralType{Type: &core.LiteralType_Simple{Simple: core.SimpleType_FLOAT}}}
	}
	return &core.VariableMap{Variables: vars}
}

func resources(cpu, memory string) *core.Resources {
	entries := []*core.Resources_ResourceEntry{
		{Name: core.Resources_CPU, Value: cpu}, {Name: core.Resources_MEMORY, Value: memory},
	}
	return &core.Resources{Requests: entries, Limits: entries}
}

// taskTemplate is what flytekit registers: a ContainerTask ("raw-container") with its DataLoadingConfig, or
// a PythonFunctionTask ("python-task") whose args are the templates Flyte fills in.
func taskTemplate(c cell) *core.TaskTemplate {
	id := &core.Identifier{ResourceType: core.ResourceType_TASK, Project: project, Domain: domain, Name: taskName, Version: "v1"}
	if c.python {
		return &core.TaskTemplate{
			Id: id, Type: "python-task", Interface: &core.TypedInterface{Inputs: variables("radius"), Outputs: variables("o0")},
			Target: &core.TaskTemplate_Container{Container: &core.Container{
				Image: "ghcr.io/flyteorg/flytekit:py3.12-latest",
				Args: []string{"pyflyte-execute", "--inputs", "{{.input}}", "--output-prefix", "{{.outputPrefix}}",
					"--raw-output-data-prefix", "{{.rawOutputDataPrefix}}", "--checkpoint-path", "{{.checkpointOutputPrefix}}",
					"--prev-checkpoint", "{{.prevCheckpointPrefix}}", "--resolver",
					"flytekit.core.python_auto_container.default_task_resolver", "--", "task-module", "workflows.circle",
					"task-name", "circle_area"},
				Resources: resources("500m", "512Mi"),
			}},
		}
	}
	iface := &core.TypedInterface{}
	if c.inputs {
		iface.Inputs = variables("radius")
	}
	if c.outputs {
		iface.Outputs = variables("area")
	}
	data := &core.DataLoadingConfig{Enabled: true, Format: core.DataLoadingConfig_JSON}
	if c.taskPaths {
		data.InputPath, data.OutputPath = "/var/inputs", "/var/outputs"
	}
	primary := &core.Container{
		Image:      "ghcr.io/flyteorg/rawcontainers-shell:v2",
		Command:    []string{"./calculate-circle-area.sh", "/var/inputs", "/var/outputs"},
		Resources:  resources("1", "1Gi"),
		DataConfig: data,
	}
	tmpl := &core.TaskTemplate{Id: id, Type: "raw-container", Interface: iface,
		Target: &core.TaskTemplate_Container{Container: primary}}
	if c.podTemplate {
		tmpl.Target = &core.TaskTemplate_K8SPod{K8SPod: &core.K8SPod{PodSpec: podTemplateSpec(), DataConfig: data}}
		tmpl.Config = map[string]string{flytek8s.PrimaryContainerKey: "primary"}
	}
	return tmpl
}

// podTemplateSpec is flytekit's serialisation of a ContainerTask with a pod template: the task's container
// becomes the template's primary container.
func podTemplateSpec() *structpb.Struct {
	logs := v1.VolumeMount{Name: "task-logs", MountPath: "/var/log/task"}
	spec := v1.PodSpec{
		InitContainers: []v1.Container{{Name: "fetch-config", Image: "docker.io/library/busybox:1.37",
			Command: []string{"sh", "-c", "echo ready > /var/log/task/ready"}, VolumeMounts: []v1.VolumeMount{logs}}},
		Containers: []v1.Container{
			{Name: "primary", Image: "ghcr.io/flyteorg/rawcontainers-shell:v2",
				Command:      []string{"./calculate-circle-area.sh", "/var/inputs", "/var/outputs"},
				VolumeMounts: []v1.VolumeMount{logs}},
			{Name: "log-forwarder", Image: "docker.io/fluent/fluent-bit:3.1",
				Args:         []string{"-i", "tail", "-p", "path=/var/log/task/*.log", "-o", "stdout"},
				VolumeMounts: []v1.VolumeMount{logs}},
		},
		Volumes: []v1.Volume{{Name: "task-logs", VolumeSource: v1.VolumeSource{EmptyDir: &v1.EmptyDirVolumeSource{}}}},
	}
	s, err := utils.MarshalObjToStruct(spec)
	if err != nil {
		panic(err)
	}
	return s
}

// workflow is the FlyteWorkflow object that owns the pod; its labels are the ones flytepropeller's compiler
// puts on it and every node copies.
func workflow(execution string) *v1alpha1.FlyteWorkflow {
	return &v1alpha1.FlyteWorkflow{ObjectMeta: metav1.ObjectMeta{
		Name: execution, Namespace: namespace, UID: types.UID("3b0d6c3e-8f2a-4f0e-9a8b-4c7d2e1f0a9b"),
		Labels: map[string]string{
			k8sTransformer.ExecutionIDLabel: execution, k8sTransformer.ProjectLabel: project,
			k8sTransformer.DomainLabel: domain, k8sTransformer.WorkflowNameLabel: "workflows-circle-wf",
			k8sTransformer.ShardKeyLabel: "21",
		},
	}}
}

func metadata(c cell, execution string) (pluginsCore.TaskExecutionMetadata, error) {
	// flytepropeller's compiler converts the node's overrides (none: an empty, non-nil requirement).
	resources, err := flytek8s.ToK8sResourceRequirements(c.resources)
	if err != nil {
		return nil, err
	}
	wf := workflow(execution)
	labels := utils.CopyMap(wf.GetLabels())
	labels[nodeIDLabel] = "n0"
	labels[taskNameLabel] = taskName
	labels[nodeInterruptibleLabel] = fmt.Sprint(c.interruptible)

	id := &coreMocks.TaskExecutionID{}
	id.OnGetGeneratedName().Return(execution + "-n0-0")
	id.OnGetUniqueNodeID().Return("n0")
	id.OnGetID().Return(core.TaskExecutionIdentifier{
		TaskId: &core.Identifier{ResourceType: core.ResourceType_TASK, Project: project, Domain: domain, Name: taskName, Version: "v1"},
		NodeExecutionId: &core.NodeExecutionIdentifier{NodeId: "n0",
			ExecutionId: &core.WorkflowExecutionIdentifier{Project: project, Domain: domain, Name: execution}},
	})

	overrides := &coreMocks.TaskOverrides{}
	overrides.OnGetResources().Return(resources)
	overrides.OnGetExtendedResources().Return(nil)
	overrides.OnGetContainerImage().Return("")
	overrides.OnGetConfig().Return(nil)

	md := &coreMocks.TaskExecutionMetadata{}
	md.OnGetNamespace().Return(namespace)
	md.OnGetLabels().Return(labels)
	md.OnGetAnnotations().Return(map[string]string{})
	md.OnGetOwnerReference().Return(wf.GetOwnerReference())
	md.OnGetOwnerID().Return(types.NamespacedName{Namespace: namespace, Name: execution})
	md.OnGetTaskExecutionID().Return(id)
	md.OnGetK8sServiceAccount().Return("")
	md.OnGetSecurityContext().Return(core.SecurityContext{RunAs: &core.Identity{}})
	md.OnGetPlatformResources().Return(&v1.ResourceRequirements{})
	md.OnGetOverrides().Return(overrides)
	md.OnIsInterruptible().Return(c.interruptible)
	md.OnGetInterruptibleFailureThreshold().Return(0)
	md.OnGetMaxAttempts().Return(1)
	md.OnGetEnvironmentVariables().Return(nil)
	md.OnGetConsoleURL().Return("")
	return md, nil
}

func taskContext(c cell, execution string) (pluginsCore.TaskExecutionContext, error) {
	md, err := metadata(c, execution)
	if err != nil {
		return nil, err
	}
	prefix := storage.DataReference(fmt.Sprintf("s3://%s/metadata/propeller/%s-%s-%s/n0/data", bucket, project, domain, execution))
	inputs := &ioMocks.InputReader{}
	inputs.OnGetInputPrefixPath().Return(prefix)
	inputs.OnGetInputPath().Return(prefix + "/inputs.pb")
	inputs.OnGetMatch(mock.Anything).Return(&core.LiteralMap{}, nil)

	outputs := &ioMocks.OutputWriter{}
	outputs.OnGetOutputPrefixPath().Return(prefix + "/0")
	outputs.OnGetOutputPath().Return(prefix + "/0/outputs.pb")
	outputs.OnGetErrorPath().Return(prefix + "/0/error.pb")
	outputs.OnGetDeckPath().Return(prefix + "/0/deck.html")
	outputs.OnGetRawOutputPrefix().Return(storage.DataReference(fmt.Sprintf("s3://%s/data/raw/%s", bucket, execution)))
	outputs.OnGetCheckpointPrefix().Return(storage.DataReference(fmt.Sprintf("s3://%s/data/checkpoints/%s", bucket, execution)))
	outputs.OnGetPreviousCheckpointsPrefix().Return("")

	reader := &coreMocks.TaskReader{}
	reader.OnReadMatch(mock.Anything).Return(taskTemplate(c), nil)
	reader.OnPathMatch(mock.Anything).Return("", nil).Maybe()

	state := &coreMocks.PluginStateReader{}
	state.OnGetMatch(mock.Anything).Return(0, nil) // a zero state: the plugin has not started the task
	writer := &coreMocks.PluginStateWriter{}
	writer.OnPutMatch(mock.Anything, mock.Anything).Return(nil)

	tCtx := &coreMocks.TaskExecutionContext{}
	tCtx.OnTaskExecutionMetadata().Return(md)
	tCtx.OnTaskReader().Return(reader)
	tCtx.OnInputReader().Return(inputs)
	tCtx.OnOutputWriter().Return(outputs)
	tCtx.OnPluginStateReader().Return(state)
	tCtx.OnPluginStateWriter().Return(writer)
	tCtx.OnDataStore().Return(nil)
	return tCtx, nil
}

// configure sets the deployment's configuration the way flytepropeller's config file would: an S3 bucket
// through stow, and the k8s plugin's defaults changed only where the cell says.
func configure(c cell, defaults config.K8sPluginConfig) error {
	if err := storage.ConfigSection.SetConfig(&storage.Config{
		Type: storage.TypeStow, InitContainer: bucket,
		Stow: storage.StowConfig{Kind: "s3", Config: map[string]string{"region": "us-east-2"}},
	}); err != nil {
		return err
	}
	cfg := defaults
	if c.copilot != nil {
		c.copilot(&cfg.CoPilot)
	}
	if c.interruptible {
		cfg.InterruptibleTolerations = []v1.Toleration{{Key: "flyte.org/interruptible", Operator: v1.TolerationOpEqual,
			Value: "true", Effect: v1.TaintEffectNoSchedule}}
		cfg.InterruptibleNodeSelectorRequirement = &v1.NodeSelectorRequirement{Key: "flyte.org/interruptible",
			Operator: v1.NodeSelectorOpIn, Values: []string{"true"}}
	}
	return config.SetK8sPluginConfig(&cfg)
}

// finalizer is the one flytepropeller's k8s plugin manager adds when the deployment sets inject-finalizer
// (flytepropeller/pkg/controller/nodes/task/k8s/plugin_manager.go@v1.14.1 L44).
const finalizer = "flyte/flytek8s"

// addObjectMetadata is flytepropeller's PluginManager.addObjectMetadata at v1.14.1
// (flytepropeller/pkg/controller/nodes/task/k8s/plugin_manager.go L107-L125), line for line, with Flyte's
// own helpers; the plugin is the pod plugin. The manager first wraps the metadata
// (newTaskExecutionMetadata, task_exec_context.go), which adds labels and annotations only for a task's
// secrets and the run's execution identity: the matrix has neither, so the wrapper is left out.
func addObjectMetadata(taskCtx pluginsCore.TaskExecutionMetadata, o client.Object, cfg *config.K8sPluginConfig) {
	o.SetNamespace(taskCtx.GetNamespace())
	o.SetAnnotations(utils.UnionMaps(cfg.DefaultAnnotations, o.GetAnnotations(), utils.CopyMap(taskCtx.GetAnnotations())))
	o.SetLabels(utils.UnionMaps(cfg.DefaultLabels, o.GetLabels(), utils.CopyMap(taskCtx.GetLabels())))
	o.SetName(taskCtx.GetTaskExecutionID().GetGeneratedName())

	if !pod.DefaultPodPlugin.GetProperties().DisableInjectOwnerReferences {
		o.SetOwnerReferences([]metav1.OwnerReference{taskCtx.GetOwnerReference()})
	}

	if cfg.InjectFinalizer && !pod.DefaultPodPlugin.GetProperties().DisableInjectFinalizer {
		f := append(o.GetFinalizers(), finalizer)
		o.SetFinalizers(f)
	}

	if errs := validation.IsDNS1123Subdomain(o.GetName()); len(errs) > 0 {
		o.SetName(utils.ConvertToDNS1123SubdomainCompatibleString(o.GetName()))
	}
}

// build runs the pod plugin and the plugin manager's metadata step, and returns the pod the manager would
// ask the API server to create.
func build(ctx context.Context, c cell) (*v1.Pod, error) {
	tCtx, err := taskContext(c, "f-"+c.name)
	if err != nil {
		return nil, err
	}
	o, err := pod.DefaultPodPlugin.BuildResource(ctx, tCtx)
	if err != nil {
		return nil, err
	}
	addObjectMetadata(tCtx.TaskExecutionMetadata(), o, config.GetK8sPluginConfig())
	p, ok := o.(*v1.Pod)
	if !ok {
		return nil, fmt.Errorf("the pod plugin built a %T, not a pod", o)
	}
	return p.DeepCopy(), nil
}

// wire encodes the pod as client-go sends it to the API server: its codec stamps the scheme's kind and
// version (Flyte's BuildIdentityPod says kind "pod"; the API server and its webhooks see "Pod").
func wire(p *v1.Pod) ([]byte, error) {
	body, err := runtime.Encode(scheme.Codecs.LegacyCodec(v1.SchemeGroupVersion), p)
	if err != nil {
		return nil, err
	}
	return yaml.JSONToYAML(body)
}

// versions names the Flyte modules this binary was built from, as the Go toolchain recorded them.
func versions() string {
	info, ok := debug.ReadBuildInfo()
	if !ok {
		return "unknown"
	}
	var parts []string
	for _, dep := range info.Deps {
		if name, found := strings.CutPrefix(dep.Path, "github.com/flyteorg/flyte/"); found {
			parts = append(parts, name+" "+dep.Version)
		}
	}
	return strings.Join(parts, ", ")
}

func run() error {
	ctx := context.Background()
	defaults := *config.GetK8sPluginConfig()
	header := versions()
	for _, c := range matrix() {
		if err := configure(c, defaults); err != nil {
			return fmt.Errorf("%s: %w", c.name, err)
		}
		p, err := build(ctx, c)
		if err != nil {
			return fmt.Errorf("%s: %w", c.name, err)
		}
		out, err := wire(p)
		if err != nil {
			return fmt.Errorf("%s: %w", c.name, err)
		}
		fmt.Printf("---\n# Flyte: %s\n# cell %s: %s\n%s", header, c.name, c.about, out)
	}
	return nil
}

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "flyte-pods:", err)
		os.Exit(1)
	}
}
