# frozen_string_literal: true

require 'puppet/parameter/boolean'
require_relative '../../puppet_x/vmhost/spec'
require_relative '../../puppet_x/vmhost/type_params'

Puppet::Type.newtype(:vmhost_vm) do
  @doc = <<~DOC
    A VM on a vmhost host, managed through vmhostd's JSON-RPC socket.

    The type checks only the shape of each attribute; every rule (names, limits, capacity,
    conflicts, networks, boot files) is the daemon's, and its refusals are reported with the
    daemon's error code, message and offending field. Attributes that are not declared are
    not managed: they keep the value the daemon has recorded.

    Changes are collected and sent once per resource, as one `vm.apply` with the full spec
    (the recorded spec with the declared attributes put over it). vmhostd changes an existing
    VM in place and keeps its disk (CPUs, memory, role, devices, NICs, kernel boot, a larger
    disk); a running VM restarts for it unless `restart => false`. Only a new boot image needs
    `replace => true` (a new disk: the old disk overlay is deleted); without it vmhostd refuses
    with error 2002 and nothing changes.

        vmhost_vm { 'web1':
          ensure => running,
          cpu    => 1,
          memory => '256M',
          boot   => { 'kernel' => '/srv/vm/vmlinuz', 'initrd' => '/srv/vm/initrd.img',
                      'cmdline' => 'console=ttyS0' },
          nics   => [{ 'network' => 'lan', 'ipv4' => { 'mode' => 'dhcp' } }],
        }
  DOC

  # Shape checks shared by the structured properties.
  shape = Module.new do
    def hash_with_string_keys!(value, what)
      raise ArgumentError, "#{what} must be a hash, not #{value.inspect}" unless value.is_a?(Hash)

      value.each_key do |k|
        raise ArgumentError, "#{what} keys must be strings, not #{k.inspect}" unless k.is_a?(String) || k.is_a?(Symbol)
      end
    end

    def integer_like!(value, what)
      ok = value.is_a?(Integer) || (value.is_a?(String) && value.match?(/\A\d+\z/))
      raise ArgumentError, "#{what} must be a non-negative integer, not #{value.inspect}" unless ok
    end
  end

  ensurable do
    desc <<~DOC
      `running`: the VM exists and its QEMU runs. `stopped`: it exists and does not run.
      `present`: it exists; its run state is not managed (a VM created with `present` is
      started, the daemon's default). `absent`: it does not exist (`vm.destroy`, which also
      deletes its disk overlay). Defaults to `present`.

      The current value is `running` while vmhostd reports the status `running`, `starting`
      or `creating`, and `stopped` for `stopped`, `stopping`, `failed` and `dead`.
    DOC

    newvalue(:running) { provider.request_ensure(:running) }
    newvalue(:stopped) { provider.request_ensure(:stopped) }
    newvalue(:present) { provider.request_ensure(:present) }
    newvalue(:absent) { provider.request_ensure(:absent) }

    defaultto :present

    def retrieve
      provider.current_ensure
    end

    def insync?(is)
      want = should
      return is != :absent if want == :present

      is == want
    end

    def change_to_s(current, desired)
      return 'created' if current == :absent
      return 'removed' if desired == :absent

      super
    end
  end

  PuppetX::Vmhost::TypeParams.name_param(self, 'The VM name (the spec\'s `name`; vmhostd checks its form).')
  PuppetX::Vmhost::TypeParams.socket_param(self)

  newparam(:replace, boolean: true, parent: Puppet::Parameter::Boolean) do
    desc <<~DOC
      Whether vmhostd may recreate the VM with a new disk when its boot image (`boot`'s
      `image`) changes (`vm.apply` with `replace: true`): QEMU is killed and the VM's disk
      overlay, seed and console log are deleted. Default `false`: such a change fails with
      error 2002. Every other change is made in place, keeping the disk, and never needs it.
    DOC

    defaultto false
  end

  newparam(:restart, boolean: true, parent: Puppet::Parameter::Boolean) do
    desc <<~DOC
      For an in-place change of a running VM (CPUs, memory, devices, NICs, kernel boot):
      `true` (default) restarts it with the new spec (ACPI power-off, QEMU killed after
      `restart_timeout` seconds, then started); `false` only records the change, which applies
      at the VM's next start (vmhostd shows `pending_restart`). A larger disk grows live
      either way.
    DOC

    defaultto true
  end

  newparam(:restart_timeout) do
    desc <<~DOC
      Seconds the guest has to power off for that restart before QEMU is killed (`vm.apply`'s
      `timeout_s`), 0 to 3600. Default 30. Added to `timeout` for the call's own wait.
    DOC
    defaultto 30

    validate do |value|
      ok = value.is_a?(Integer) || (value.is_a?(String) && value.match?(/\A\d+\z/))
      unless ok && (0..3600).cover?(Integer(value.to_s, 10))
        raise ArgumentError,
              "restart_timeout must be a whole number of seconds from 0 to 3600, not #{value.inspect}"
      end
    end
    munge { |value| Integer(value.to_s, 10) }
  end

  newparam(:timeout) do
    desc 'Seconds to wait for vmhostd\'s answer to a changing call (`vm.apply`, `vm.destroy`). Default 300.'
    defaultto 300

    validate do |value|
      ok = value.is_a?(Numeric) || (value.is_a?(String) && value.match?(/\A\d+(\.\d+)?\z/))
      unless ok && Float(value).positive?
        raise ArgumentError,
              "timeout must be a positive number of seconds, not #{value.inspect}"
      end
    end
    munge { |value| Float(value) }
  end

  # A VM booting from an image comes after the vmhost_image that puts it there.
  autorequire(:vmhost_image) do
    boot = self[:boot]
    image = boot.is_a?(Hash) ? boot['image'] : nil
    image.is_a?(String) ? [image] : []
  end

  newproperty(:role) do
    desc 'A free label (spec `role`).'

    validate do |value|
      raise ArgumentError, "role must be a string, not #{value.inspect}" unless value.is_a?(String)
    end
  end

  newproperty(:cpu) do
    desc 'Number of virtual CPUs (spec `cpu`). Required to create a VM.'
    extend shape

    validate { |value| self.class.integer_like!(value, 'cpu') }
    munge { |value| Integer(value.to_s, 10) }
  end

  newproperty(:memory) do
    desc <<~DOC
      Memory in MiB (spec `memory_mib`). An integer is MiB; a string may carry a binary
      unit: `'512'`, `'512M'`, `'512MiB'`, `'2G'`, `'2GiB'` (G = 1024 MiB). Reported in MiB.
      Required to create a VM.
    DOC

    validate do |value|
      if PuppetX::Vmhost::Spec.memory_mib(value).nil?
        raise ArgumentError,
              "memory must be MiB or a size such as '512M' or '2G', not #{value.inspect}"
      end
    end
    munge { |value| PuppetX::Vmhost::Spec.memory_mib(value) }
  end

  newproperty(:hardware) do
    desc <<~DOC
      Passthrough devices by the host's hardware model (spec `hardware`): a hash from class
      (`disk`, `copper`, `sfp`) to an array of indices, e.g. `{ 'sfp' => [5], 'copper' => [1] }`.
      An empty class is the same as a missing one. Order within a class matters to vmhostd.
    DOC
    extend shape

    validate do |value|
      self.class.hash_with_string_keys!(value, 'hardware')
      value.each do |cls, indices|
        unless indices.is_a?(Array)
          raise ArgumentError,
                "hardware #{cls} must be an array of indices, not #{indices.inspect}"
        end

        indices.each { |i| self.class.integer_like!(i, "hardware #{cls} index") }
      end
    end
    munge { |value| PuppetX::Vmhost::Spec.normalize_hardware(value) }

    def insync?(is)
      PuppetX::Vmhost::Spec.same?(:hardware, is, should)
    end
  end

  newproperty(:pci, array_matching: :all) do
    desc <<~DOC
      Passthrough devices by PCI address (spec `pci`), e.g. `['0000:ca:00.0']`. vmhostd accepts
      them only when its config sets `hardware.allow_raw_pci`, and compares them as written.
    DOC

    validate do |value|
      raise ArgumentError, "pci entries must be strings, not #{value.inspect}" unless value.is_a?(String)
    end

    def insync?(is)
      PuppetX::Vmhost::Spec.same?(:pci, is, should)
    end
  end

  newproperty(:boot) do
    desc <<~DOC
      How the VM boots (spec `boot`), a hash: `{ 'image' => 'base.qcow2', 'disk_gib' => 4 }`
      or `{ 'kernel' => '/path/vmlinuz', 'initrd' => '/path/initrd', 'cmdline' => '...' }`
      (the kernel and initrd in one of the host's boot directories, vmhostd's `paths.boot`),
      or `{ 'disk' => 'old-vm.qcow2', 'disk_gib' => 40 }` to import an existing disk from the
      host's `paths.import` as the VM's own root disk (docs/storage.md; never changed later).
      Any of them may add `'firmware' => 'uefi'` (OVMF, docs/images.md); leave it out for BIOS,
      the default, which vmhostd leaves out of the recorded spec. With `uefi`,
      `'secure_boot' => true` turns Secure Boot on. `'firmware' => 'bios'` and
      `'secure_boot' => false` compare equal to a recorded spec without them.
      Compared as a whole otherwise. Required to create a VM.
    DOC
    extend shape

    validate { |value| self.class.hash_with_string_keys!(value, 'boot') }
    munge { |value| PuppetX::Vmhost::Spec.normalize(value, 'boot') }

    def insync?(is)
      PuppetX::Vmhost::Spec.same?(:boot, is, should)
    end
  end

  newproperty(:nics, array_matching: :all) do
    desc <<~DOC
      The VM's NICs in guest order (spec `nics`), an array of hashes:
      `{ 'network' => 'lan', 'vlan' => 10, 'mac' => '52:54:00:12:34:56',
         'ipv4' => { 'mode' => 'static', 'address' => '10.0.0.5/24', 'gateway' => '10.0.0.1',
                     'dns' => ['10.0.0.1'], 'search' => ['example.org'] } }`
      or `'ipv4' => { 'mode' => 'dhcp' }`, and `'queues' => 4` for that many queue pairs
      (multiqueue tap and virtio-net, 1 to 16; 1, the default, is what a NIC without it has).
      A bridged NIC may carry tagged VLANs besides its access `vlan`: `'vlans' => [10, 20]`
      or `'trunk' => true` (every VLAN; a network with `vlan_filtering`). A capture NIC is
      `{ 'mode' => 'monitor', 'source' => 'eth1', 'direction' => 'ingress' }`: copies of the
      host interface's frames (`direction` `both`, the default, or `ingress`), nothing sent
      back; no `network`, `mac`, `vlan` or `ipv4`; the source must be in the host's
      `[capture] interfaces` (else vmhostd's 3001 on `spec.nics[N].source`). `mode => bridge`
      and `trunk => false` are what a NIC without them has. A change of these restarts a
      running VM. Compared as a whole, in order. `nics => []` declares a VM without NICs.
    DOC
    extend shape

    validate { |value| self.class.hash_with_string_keys!(value, 'each nic') }
    munge { |value| PuppetX::Vmhost::Spec.normalize(value, 'nics') }

    def insync?(is)
      PuppetX::Vmhost::Spec.same?(:nics, is, should)
    end
  end

  newproperty(:disks, array_matching: :all) do
    desc <<~DOC
      The VM's data disks after its boot disk, in guest order (spec `disks`), an array of
      hashes `{ 'name' => 'nsm', 'size_gib' => 500, 'format' => 'raw', 'preallocate' => true,
      'keep_on_destroy' => true }` (optional members: `format` qcow2 or raw, `preallocate`,
      `cache` none or writeback, `aio`, `keep_on_destroy`, `snapshot`: `false` leaves the disk
      out of the VM's snapshots; `true`, the default, compares equal to a recorded disk
      without it). A larger `size_gib` grows the disk
      live; adding or dropping one restarts a running VM; a smaller size is refused (2001).
      Leave out members at their defaults (the daemon echoes none of them). `disks => []`
      declares a VM without data disks.
    DOC
    extend shape

    validate { |value| self.class.hash_with_string_keys!(value, 'each disk') }
    munge { |value| PuppetX::Vmhost::Spec.normalize(value, 'disks') }

    def insync?(is)
      PuppetX::Vmhost::Spec.same?(:disks, is, should)
    end
  end

  newproperty(:guest_interfaces, array_matching: :all) do
    desc <<~DOC
      Interfaces the guest agent creates in the guest (spec `guest_interfaces`), an array of
      hashes `{ 'name' => 'eth0.20', 'link' => 'eth0', 'vlan_id' => 20, 'address' => '10.20.0.5/24' }`.
      vmhostd applies a change live (no restart, no `replace` needed); on a running VM that
      needs a connected guest agent (else error 5001).
    DOC
    extend shape

    validate { |value| self.class.hash_with_string_keys!(value, 'each guest interface') }
    munge { |value| PuppetX::Vmhost::Spec.normalize(value, 'guest_interfaces') }

    def insync?(is)
      PuppetX::Vmhost::Spec.same?(:guest_interfaces, is, should)
    end
  end

  # Values :true / :false, not Ruby booleans: Puppet never syncs a property whose should is
  # `false`. Spec.build sends them as JSON booleans.
  newproperty(:guest_exec) do
    desc <<~DOC
      Whether vmhostd may run commands and transfer files in this guest (`vm.exec`,
      `vm.file_push`, `vm.file_pull`; spec `guest_exec`). `false` makes vmhostd refuse them
      with error 4095 (`reason: spec`). The host must allow them too (`[agent] allow_exec` in
      vmhostd's config); `true` does not override that. vmhostd changes it without a restart
      (it is checked when a call comes). Not declared: left as recorded (vmhostd's default is
      `true`).
    DOC

    newvalues('true', 'false')

    def insync?(is)
      PuppetX::Vmhost::Spec.same?(:guest_exec, is, should)
    end
  end

  newproperty(:cpu_policy) do
    desc <<~DOC
      Whether the VM's vCPUs share host CPUs (`shared`, vmhostd's default) or each gets a host
      CPU of its own (`dedicated`; spec `cpu_policy`). `dedicated` needs `[hardware] vm_cpus`
      in vmhostd's config (else error 3001 on `spec.cpu_policy`) and enough free VM CPUs
      (else 3002 with the numbers). A change restarts a running VM (`restart => false` leaves
      it pending). Not declared: left as recorded; a VM whose view has none is `shared`.
    DOC

    validate do |value|
      raise ArgumentError, "cpu_policy must be a string, not #{value.inspect}" unless value.is_a?(String)
    end
  end

  newproperty(:numa) do
    desc <<~DOC
      NUMA placement of the VM's CPUs and memory (spec `numa`): `auto` (one node: its
      passthrough devices' node, else the one with most room), `spread` (several nodes when one
      is too small), `none` (no binding) or a node number such as `1`. Not declared: left as
      recorded; vmhostd places a VM without one as `auto` when dedicated, `none` when shared,
      and `numa => absent` goes back to that. A change restarts a running VM.
    DOC

    validate do |value|
      ok = value.is_a?(String) || (value.is_a?(Integer) && !value.negative?)
      raise ArgumentError, "numa must be a string or a node number, not #{value.inspect}" unless ok
    end
    # vmhostd takes a node as a JSON number: '1' is node 1.
    munge { |value| value == 'absent' ? :absent : PuppetX::Vmhost::Spec.integerish(value) }
  end

  newproperty(:hugepages) do
    desc <<~DOC
      Back the guest's memory with hugepages of this size (spec `hugepages`): `2M` or `1G`,
      taken from the host's free pool on the VM's node when it starts (error 3002 when too few
      are free; `memory` must be a multiple of the page size, else 2001). `hugepages => absent`
      removes it (normal memory, transparent hugepages). A change restarts a running VM.
    DOC

    validate do |value|
      raise ArgumentError, "hugepages must be a string, not #{value.inspect}" unless value.is_a?(String)
    end
    munge { |value| value == 'absent' ? :absent : value }
  end

  # :true / :false as for guest_exec (Puppet never syncs a should of `false`).
  newproperty(:emulator_cpu) do
    desc <<~DOC
      Whether a `dedicated` VM gets one more dedicated host CPU, on its node, for QEMU's own
      threads (I/O, the main loop) besides its vCPUs (spec `emulator_cpu`; vmhostd refuses it
      without `cpu_policy => dedicated`, error 2001). Not declared: left as recorded; a VM
      whose view has none is `false`. A change restarts a running VM.
    DOC

    newvalues('true', 'false')

    def insync?(is)
      PuppetX::Vmhost::Spec.same?(:emulator_cpu, is, should)
    end
  end

  # :true / :false as for guest_exec (Puppet never syncs a should of `false`).
  newproperty(:tpm) do
    desc <<~DOC
      Whether the guest gets a TPM 2.0 (spec `tpm`; swtpm on the host, its state kept until
      the VM is destroyed). The host needs `qemu.swtpm` (else vmhostd's 2001 on `spec.tpm`);
      a VM with it is not moved (`vm.move`, `vm.migrate`: 4097). Not declared: left as
      recorded; a VM whose view has none is `false`. A change restarts a running VM.
    DOC

    newvalues('true', 'false')

    def insync?(is)
      PuppetX::Vmhost::Spec.same?(:tpm, is, should)
    end
  end

  newproperty(:ssh) do
    desc <<~DOC
      SSH access to the guest (spec `ssh`): a hash `{ 'user' => 'ops', 'keys' => ['ssh-ed25519
      AAAA... ops@example.org'] }`, an account (optional, vmhostd's default `vmhost`, created
      when missing, no sudo) and the complete list of OpenSSH public keys that may log in to it
      (1 to 16). vmhostd checks the user name and the keys (2001 on `spec.ssh...`) and writes
      them through the cloud-init seed and the guest's exec server. A change is applied live
      (no restart, no `replace` needed); on a running VM that needs the guest's exec server
      (`vmhost-agent --exec`, else error 5001; the new value stays recorded and is written at
      the agent's next session). `ssh => {}` removes it from the spec (nothing is deleted in
      the guest).
    DOC
    extend shape

    validate { |value| self.class.hash_with_string_keys!(value, 'ssh') }
    munge { |value| PuppetX::Vmhost::Spec.normalize(value, 'ssh') }

    def insync?(is)
      PuppetX::Vmhost::Spec.same?(:ssh, is, should)
    end
  end
end
